"""The KV connectors the scheduler consults: the `KVConnector` interface (base.py), prefill-to-decode
transfer (pd_connector.py) and a chain of several (connector_chain.py). The KV tiers' connector lives in
backends/kv_connectors/tiers/."""
