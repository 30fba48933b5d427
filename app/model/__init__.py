"""Building the model a worker trains: what the architecture is (`architecture`), the meta-device
build with precision, LoRA and FSDP2/DDP (`build`), each rank's own weight bytes (`weights`), NF4
for QLoRA (`quantize`), sharding and compile (`sharding`), the loss (`loss`), row-keyed dropout
(`dropout`) and model FLOPs (`mfu`)."""
