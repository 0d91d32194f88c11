"""Always fails, like a call to a dependency that is down: retried with backoff, then dead."""
import json
import sys

payload = json.load(open(sys.argv[1]))
print(f"calling {payload.get('url', 'the upstream API')} ...", file=sys.stderr)
raise RuntimeError("upstream API answered 503 Service Unavailable")
