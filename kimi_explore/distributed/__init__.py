"""K3 past one machine: `RayPipeline` (stages as Ray actors). Ray is imported only when a pipeline is made."""
