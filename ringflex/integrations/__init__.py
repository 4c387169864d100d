"""Adapters to other libraries; each one is optional and imports its library only when used."""
