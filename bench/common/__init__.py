"""What several benches share: child processes, servers, another checkout's engine, the host."""
