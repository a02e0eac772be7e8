"""A tensor-parallel engine: one engine core over `--tensor-parallel-size` processes.

Rank 0 is the engine's core process as always (scheduler, KV page table, prefix cache,
sampling, the frontend's socket); ranks 1..N-1 are worker processes it starts, each holding its
share of the model and of every KV page on GPU `--device` + rank. The scheduler exists once:
each call rank 0 makes on its model runner (a step's forward, the sampled tokens, a KV
allocation) is sent first to every worker, which makes the same call on its own runner, so the
collectives inside (two all-reduces per layer, the logits' gather) meet in the same order on
every rank. This is nano-vllm's design (rank 0 drives, the others replay its calls) rather than
mini-sglang's (a scheduler per rank fed the same requests): with one scheduler there is one
page table, one prefix cache and one place a scheduling decision is made, and a worker is a
loop of forty lines that cannot disagree with rank 0 about what runs.

    runner.py  TensorParallelRunner: rank 0's runner, which forwards each call
    worker.py  the worker process's loop
    group.py   joining the process group (NCCL on GPUs, gloo on CPUs), with a timeout
"""
