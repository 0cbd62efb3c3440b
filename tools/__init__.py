"""Tools beside the runtime: draft-model training, model compression, benchmark runners. They import
`backends`; nothing in `backends` imports them."""
