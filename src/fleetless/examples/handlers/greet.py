"""Say hello. Payload: {"name": "..."}."""
import json
import sys

payload = json.load(open(sys.argv[1]))
print(f"Hello, {payload.get('name', 'world')}!")
