"""posenc's own model: the attention module, the byte-level decoder built from it, and what runs it.

    attention.py   Attention: q/k/v projections around one :func:`posenc.attend` call per forward
    lm.py          LM and LMConfig: a small decoder whose layers follow a Schedule
    schedule.py    Layer and Schedule: the encoding and attention kind of each layer
    cache.py       the KV cache (full or windowed) that decoding keeps per layer
    generate.py    greedy and sampled decoding over the cache
    checkpoint.py  save_checkpoint / load_checkpoint: safetensors weights and a JSON config
"""
