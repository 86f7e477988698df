"""The eviction runtime both adapters share: the hand-off from a cache's ``update`` to the kvlib
attention function (:mod:`.layer_step`, :mod:`.attention`), masks over stored slots, and the
compressor that evicts after attention (:mod:`.compressor` with its scoring helpers)."""
