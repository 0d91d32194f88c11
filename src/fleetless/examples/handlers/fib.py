"""A little CPU work. Payload: {"n": 25}."""
import json
import sys


def fib(n: int) -> int:
    return n if n < 2 else fib(n - 1) + fib(n - 2)


n = int(json.load(open(sys.argv[1]))["n"])
print(f"fib({n}) = {fib(n)}")
