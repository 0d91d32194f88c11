"""Workflow graphs' labels: which connected graph of jobs each job of a workflow belongs to.

Retention prunes a graph as a whole (docs/workflows.md), so it must tell, for a finished job,
whether any job of its graph still runs, waits or is young, without walking the graph: every job
of a graph carries the graph's label in ``jobs.graph_id`` (migration 028), the smallest job id of
the graph. An enqueue with parents (one job, or an ``enqueue_many`` graph) collects its edges
here; once its jobs are written, :meth:`Labels.step` says what to write in the same
transaction: the labels of the call's own jobs, and the relabelling of the existing graphs a new
child joined together (their larger labels become the smallest). Queue and AsyncQueue run the
statements, each on its own driver.

A call that joins two or more graphs first locks each one's row of ``graph_joins`` (migration 029;
:meth:`Labels.join_slots` says which), in slot order, before it locks any job of them: two joins
of a common graph take turns instead of each holding a share lock on a job the other relabels (a
deadlock). Calls that join nothing lock no slot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

#: The rows of graph_joins (migration 029): a graph's slot is its label modulo this.
JOIN_SLOTS = 1024


class Labels:
    """A union-find of job ids: the graphs an enqueue's edges make, each led by its smallest id.

    An enqueue feeds it each child it wrote (:meth:`child`) and, after each write of children,
    runs :meth:`step`'s statements: so an ``enqueue_many`` that writes its items in several
    statements labels each lot before settling it, and relabels in the database what an earlier
    lot labelled once a later child joins that graph to a smaller one."""

    def __init__(self) -> None:
        self._up: dict[int, int] = {}
        self._children: set[int] = set()
        self._own: set[int] = set()  # jobs this call wrote without parents, that may be parents
        self._unset: set[int] = set()  # those of them now in a graph, their label not set yet
        self._read: set[int] = set()
        self._stored: set[int] = set()  # the labels the database holds for jobs of these graphs

    def _find(self, job_id: int) -> int:
        up = self._up
        root = job_id
        while up.setdefault(root, root) != root:
            root = up[root]
        while up[job_id] != root:  # path compression
            up[job_id], job_id = root, up[job_id]
        return root

    def _union(self, a: int, b: int) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:  # the smaller id leads: the label every job of the graph takes
            self._up[max(ra, rb)] = min(ra, rb)

    def wrote(self, job_id: int) -> None:
        """A job this call wrote without parents that a later child may name: no other transaction
        sees it, so its label is set with the children's (graph_label_set), never read first."""
        self._own.add(job_id)

    def child(self, child: int, parents: Iterable[int]) -> None:
        """A child this call wrote, with its parents (jobs of this call or existing ones)."""
        self._children.add(child)
        self._find(child)
        for parent in parents:
            if parent in self._own and parent not in self._up:
                self._unset.add(parent)
            self._union(child, parent)

    def unread(self) -> list[int]:
        """The parents not read yet that are no child of this call (jobs written before it, or by
        it without parents), whose labels the database holds: graph_label_fresh gives those in no
        graph yet one of their own, graph_labels locks and reads them. Marked read."""
        ids = sorted(j for j in self._up if j not in self._children and j not in self._own and j not in self._read)
        self._read.update(ids)
        return ids

    def may_join(self, ids: Sequence[int]) -> bool:
        """Whether reading these parents' labels could show a join: more than one graph among them
        and the call's labelled graphs. A single parent of a call that has none (a chain's or a
        fan-out's enqueue) joins nothing, and costs no read to say so."""
        return len(ids) + len(self._stored) > 1

    def join_slots(self, read: Mapping[int, int | None]) -> list[int]:
        """Given these parents' labels (id -> graph_id; None, in no graph yet: it will be its own),
        the graph_joins slots to lock, in order, before locking any of them: those of every graph
        the call's graph joins to another (its stored labels count); empty when it joins none."""
        graphs: dict[int, set[int]] = {}
        for label in self._stored:
            graphs.setdefault(self._find(label), set()).add(label)
        for job_id, read_label in read.items():
            graphs.setdefault(self._find(job_id), set()).add(job_id if read_label is None else read_label)
        return sorted({label % JOIN_SLOTS for labels in graphs.values() if len(labels) > 1 for label in labels})

    def step(self, found: Mapping[int, int], children: Sequence[int]) -> tuple[dict[str, list[int]],
                                                                            dict[str, list[int]]]:
        """Given the labels graph_labels read (``found``: id -> graph_id), the parameters of
        graph_relabel (labels the database holds that are no longer their graph's: old -> new;
        empty unless this call joined two labelled graphs) and of graph_label_set (``children``,
        the ones just written, and this call's own parents of theirs not labelled yet -> their
        label)."""
        for job_id, label in found.items():
            self._union(job_id, label)
        self._stored.update(found.values())
        olds = sorted(label for label in self._stored if self._find(label) != label)
        relabel = {"old": olds, "new": [self._find(label) for label in olds]}
        ids = [*children, *sorted(self._unset)]
        self._unset.clear()
        assign = {"ids": ids, "labels": [self._find(j) for j in ids]}
        self._stored = {self._find(label) for label in self._stored} | set(assign["labels"])
        return relabel, assign
