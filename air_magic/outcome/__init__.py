"""How a call ended: the one ledger of its ranks' facts, the root-cause rule, its texts.

    ledger.py       CallLedger: the nodes' facts -> events and the outcome (classify_exit: how a
                    rank ended), the timeout's and the stop's texts
    failures.py     the root cause (root_cause_order, root_cause_rank) and the exception built
    result_text.py  a run's result as JSON, for a follower that unpickles nothing
    stacks.py       every thread's stack of running ranks (py-spy, else the ranks' own signal)

Knows no backend: the call loop of every backend, and a persistent session's cells, use it.
"""
