"""Routers behind one address share what they send where, so they place requests as one."""
