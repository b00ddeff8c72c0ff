"""The kernel families that `kernels.base.FAMILY_MODULES` names: each module defines a `Family`
(and its `Kernel`) and registers it, importing only `kernels.family` from the lifecycle's side.
The modules users import (`kernels.prefill`, `kernels.decode`, `kernels.linear.*`,
`kernels.fused.*`) are the launchers above the lifecycle."""
