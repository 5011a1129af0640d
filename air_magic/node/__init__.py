"""What runs on each node of a call: its rank group, the warm starter, the rendezvous store.

One package, imported alike by the local backend (``backends/local/``: this machine
is the one node) and by a Ray node's agent (``backends/ray/agent.py``):

    rank_group.py    RankGroup: one call's ranks on one node (start, watch, stop), made of
                     rank_start.py, rank_watch.py (one selector over pipes and pidfds) and
                     rank_stop.py; group_spec.py says what the group runs
    ranks.py         one rank's process: a fork of the warm starter or a fresh interpreter
    warm.py          the warm starter (torch imported once), starter_main.py its own code
    rendezvous.py    torch's TCPStore on 127.0.0.1, served by a fork of the warm starter
    session_pipes.py a persistent session's two named pipes per rank
    open_files.py    the open-file limit a group's ranks need
"""
