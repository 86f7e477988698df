"""Page formats: how a pool holds its pages' keys and values (float arenas, coded by a codec, tiered
over device, host and disk, coded and tiered, partnered with another layer's pages)."""
