"""KV transfer between workers: the `KVTransport` interface and switchyard's TCP implementation."""
from backends.kv_transfer.base import (
                                       ChecksumKind,
                                       KVBlockSink,
                                       KVBlockSource,
                                       KVDtype,
                                       KVErrorCode,
                                       KVLayerReader,
                                       KVLayerWriter,
                                       KVLayout,
                                       KVTransferConfig,
                                       KVTransferError,
                                       KVTransport,
                                       PullResult,
                                       ReleaseMode,
                                       prefill_kv_transfer_params,
)
from backends.kv_transfer.tcp import TcpTransport

__all__ = ["ChecksumKind", "KVBlockSink", "KVBlockSource", "KVDtype", "KVErrorCode",
           "KVLayerReader", "KVLayerWriter", "KVLayout", "KVTransferConfig", "KVTransferError", "KVTransport",
           "PullResult", "ReleaseMode", "TcpTransport", "prefill_kv_transfer_params"]
