"""Recording a run: per-step metrics (`metrics`), TensorBoard and MLflow (`sinks`), events and
heartbeats (`records`), the run summary (`summary`) and which transport NCCL picked (`nccl`)."""
