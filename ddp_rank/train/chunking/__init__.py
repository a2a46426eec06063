"""The chunked step and its size: a local batch embedded in chunks, the loss on the whole gathered batch, and the
chunk size chosen (``distributed.chunk_size=auto``) and confirmed on the device.

- ``step``: ``forward_backward``, the direct and the chunked step (embed without graph, loss, re-embed chunk by
  chunk with the embedding gradient);
- ``captured``: the chunks of one shape run as a captured (compiled) graph;
- ``layout``: the batch layout of a run (global batch, each rank's share, the chunk, the BatchNorm mode);
- ``step_memory`` / ``host_memory``: what a step needs on the device besides activations, and the host's limit;
- ``choice``: the chunk size extrapolated from probe batches; ``confirm``: the chunk tried on the run's engine,
  backing off on out-of-memory; ``auto``: the two, as the trainer calls them;
- ``plan_report``: ``ddp-rank plan``, the dry run reporting the layout and memory a config gets on W ranks.
"""
