"""The kubelet side: the gRPC DevicePlugin server, registration, and the kubelet restart watch."""
