"""`resa`: ReSA, "Rectified Sparse Attention" (Sun et al., 2025).

- Prefill: dense and chunked, as `dense`; every chunk also refreshes the min/max key descriptors of the blocks
  it wrote (kernels/block_descriptors). With the centroid rule they hold max + mean and min + mean: the bound and
  the centroid's product from two descriptors instead of three, a third fewer bytes to read per step. With
  descriptor_dtype int8 they are int8 codes of a scale per block and KV head, rounded outwards: half the bytes.
- Decode, on every full-attention layer: the new key updates its block's descriptors (in the launch that writes
  its K/V, kernels/kv_append; on CUDA on a side stream, beside the selection), the GQA group's mean query scores
  all blocks with Quest's bound and keeps the top k (the local blocks always; kernels/block_select), and attention
  reads only those blocks (kernels/sparse_decode_attention). Sliding-window layers (Gemma 3) stay exact: they
  already read only their window.
- Rectification: every `rectify_every` (f) tokens, a step feeds the f - 1 tokens of the sparse steps before it
  again with its own, in one dense pass (kernels/decode_attention with f queries): their K/V and descriptors are
  overwritten, its own written exact, and its logits come from that pass. Batched with the step, the
  rectification reads the weights the step reads anyway and takes that step's place: f tokens re-encoded in
  one pass that reads the whole cache once, instead of a pass of f tokens and a sparse step. On GPU each form
  of the step is a captured CUDA graph.
- select_ahead: each decode step selects the next step's blocks with its own query, after its sparse attention;
  on CUDA on a stream of its own, which the step joins at its end, so the selection leaves the path from one
  layer to the next (the first decoded token's blocks come from the question's last query). On one device the
  covered layers' descriptors and selection buffers are slices of stacked tensors: each layer keeps its query
  and the last one selects for all of them in one call, the launches' fixed costs paid once a step.
- Where the rule keeps every block at every length the cache can reach (a document and its answer under the
  floor), decode steps attend with the dense kernel: no selection and no rectification, as `dense` decodes.

The cache, its layers and the document state are in cache.py; the engine (`engines.resa.engine.ResaEngine`,
loaded through `engines.ENGINES`) in engine.py.
"""
