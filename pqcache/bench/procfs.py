"""Writing a Linux /proc or /sys setting from a benchmark: True when the kernel took it, False where it refused
(not Linux, not root, a container that forbids it), so the benchmark can say what it measured instead."""


def proc_write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False
