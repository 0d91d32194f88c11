"""Count words and lines of a text. Payload: {"text": "..."}."""
import json
import sys

text = json.load(open(sys.argv[1]))["text"]
print(json.dumps({"words": len(text.split()), "lines": text.count("\n") + 1}))
