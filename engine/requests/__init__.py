"""A user request's way in and out of the engine: what is checked and derived before it queues,
and its sequences' outputs and stop conditions as steps append tokens."""
