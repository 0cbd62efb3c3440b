"""Device-specific layer kernels: the interface (base.py), one file per device family, and the registry
(registry.py) that picks a family once, when a model is built."""
