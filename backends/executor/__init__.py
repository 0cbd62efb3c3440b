"""One worker over a group of ranks: rank 0 spawns and drives ranks 1..N-1 step by step (vLLM's multiprocess
executor), each holding a shard of the model (its pipeline stage's layers, its tensor-parallel slices of them);
torch.distributed carries the collectives inside the forward and the activations between stages.

Below the engine (which builds a group when it has more than one rank), above the model runner it wraps.
"""
