"""Copy a pool entry into a model's parameters (imports torch: only inside model processes).

- :mod:`spswap.transfer.dtypes`: safetensors dtype names <-> torch dtypes.
- :mod:`spswap.transfer.mapping`: a read-only mmap of an entry's ``data.bin`` with a
  torch view per tensor.
- :mod:`spswap.transfer.cuda_host`: ``cudaHostRegister`` of that mapping.
- :mod:`spswap.transfer.staging`: the staged copy's plan (pure).
- :mod:`spswap.transfer.copy`: checks and the copy itself.
"""
