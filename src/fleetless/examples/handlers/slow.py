"""Hangs past its timeout: the sandbox kills it and everything it started."""
import time

time.sleep(3600)
