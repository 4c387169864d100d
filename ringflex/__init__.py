"""ringflex: context-parallel ring attention with FlexAttention-style mods at global positions."""
