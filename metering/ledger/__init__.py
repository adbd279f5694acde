"""The ledger: one event per request that reached an upstream, and the rollups of them.

event.py declares the event's columns once (the table, the insert and the readers use it);
tables.py holds the ledger's tables (events, archive, rollups, pending increments); outcome.py
makes an event from an attempt's outcome or an expired hold, external.py from usage reported
from outside and from adjustments; charge.py checks and prices the usage it records; writer.py
appends it, with its rollup increments, inside the caller's transaction; rollup.py folds them
into the hourly and daily sums; retention.py moves old events to the archive. Nothing else
writes these tables.
"""
