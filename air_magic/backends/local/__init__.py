"""The local backend: one process per rank on this machine, fresh or forked from the warm starter."""
