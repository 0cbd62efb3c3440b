"""The records every backend layer shares (sequence, sampling parameters, outputs, batch, block manager,
KV events, the engine's configuration and errors): the bottom layer, importing nothing else of `backends`."""
