"""The helpers the registered backends share; none of these modules is a backend.

- ``base``: masks, ``accumulation_dtype``, ``needs_grad``; re-exports ``ScoreSpec``;
- ``regions``: kernel regions, the CPU flash kernel or its formula, the log-sum-exp merge, the
  region backward;
- ``denormals``: the denormal-flushing worker thread the kernel loops run on, and ``opaque_to_compile``;
- ``band``: the band near the diagonal, batched blocks on overlapping windows of k and v;
- ``tails``: ``blocked``'s plan for a bias with affine tails;
- ``explicit``: ``blocked``'s path for biases without affine tails;
- ``distance``: ``terms``'s Transformer-XL path;
- ``disentangled``: ``terms``'s DeBERTa path (band + far keys); ``disentangled_band`` its band, written out;
- ``single``: one query against a KV cache (a decode step);
- ``padding``: left-padded rows split into unpadded calls;
- ``sliding``: a causal sliding window as flash-kernel triangles (``windows`` calls it);
- ``windows``: sliding windows, chunked attention and attention sinks around one backend call
  (``posenc.attend`` calls it, handing it the backend call).
"""
