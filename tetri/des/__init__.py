"""A discrete-event simulator of a TetriInfer (or vanilla vLLM) cluster on the roofline cost model.

`workloads` builds the paper's workloads, `cluster.simulate` runs one on a virtual clock with the same
scheduling objects the live workers use (`tetri.scheduling`), `metrics` turns per-request records into
the paper's metrics and `experiments` runs the bench and the ablations as plain data. No wall clock, no
asyncio, no I/O.
"""
