"""Running a model on its device: the runner and its one flattened forward, CUDA graphs of the
small steps, the KV memory plan of every model, and the model drafters' runners."""
