"""bench.peers: microserve and vLLM side by side on one machine (`python -m bench.peers`), and
the scripts that bring vLLM onto a machine without registry access (README.md here)."""
