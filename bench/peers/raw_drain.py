"""The raw-SQL ceiling as a whole process: claim N with the seed's statement, complete the batch
with one UPDATE, until nothing is pending.  python raw_drain.py DSN N"""

import sys

import psycopg

CLAIM = """
UPDATE raw_jobs SET status = 'running', locked_at = now(), attempts = attempts + 1
WHERE id IN (SELECT id FROM raw_jobs WHERE status = 'pending' AND run_after <= now()
             ORDER BY run_after FOR UPDATE SKIP LOCKED LIMIT %s)
RETURNING id, kind, payload, attempts, max_attempts"""
DONE = "UPDATE raw_jobs SET status = 'done' WHERE id = ANY(%s)"


def main() -> None:
    dsn, n = sys.argv[1], int(sys.argv[2])
    done = 0
    with psycopg.connect(dsn, autocommit=True) as c:
        while True:
            rows = c.execute(CLAIM, (n,)).fetchall()
            if not rows:
                break
            c.execute(DONE, ([r[0] for r in rows],))
            done += len(rows)
    print(done)


if __name__ == "__main__":
    main()
