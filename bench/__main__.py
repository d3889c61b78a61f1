"""Run every benchmark: `python -m bench` (or `make bench`)."""

from bench import train_throughput

if __name__ == "__main__":
    train_throughput.main()
