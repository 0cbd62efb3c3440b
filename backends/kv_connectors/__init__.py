"""The KV connectors the scheduler consults: the `KVConnector` interface and its optional parts (base.py),
prefill-to-decode transfer (pd_connector.py), the KV tiers below the device pool (tiers/), several
composed into one (multi.py), and the registry from configured name to factory (registry.py)."""
