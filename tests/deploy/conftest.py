"""Fixtures of the shipping checks (chart, Dockerfile, dashboards, types): none of their own yet."""
