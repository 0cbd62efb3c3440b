"""One worker over a group of ranks: rank 0 spawns and drives ranks 1..N-1 step by step (vLLM's multiprocess
executor), each holding a shard of the model; torch.distributed carries the collectives inside the forward.

Below the engine (which builds a group when `tensor_parallel_size` > 1), above the model runner it wraps.
"""
