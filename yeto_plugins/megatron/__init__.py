"""The Megatron core of an island, for every trainer built on megatron-core (ms-swift's
`megatron sft`, and any Megatron training loop): global names (`names`), fp32 masters
(`masters`), the island's collective store (`store`) and `MegatronDiLoCoSync` (`sync`).

Importing this package loads neither megatron-core nor torch.distributed; its modules do.
"""
