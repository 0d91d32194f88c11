"""Enqueueing from an app's own database layer: :mod:`.sqlalchemy` and :mod:`.django`. Each one
finds the driver connection under the app's session and enqueues on it, so the job joins the
app's transaction: it exists if the app commits and not otherwise."""
