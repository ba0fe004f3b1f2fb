"""Adapters that plug flashattn_ext into other libraries. Each submodule imports its
library on import, so ``import flashattn_ext`` alone never needs them."""
