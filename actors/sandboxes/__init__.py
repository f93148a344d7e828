"""One sandbox: its state machine (Sandbox), one run of its QEMU (Life), its workloads and files."""
