"""Fleet simulator (agentkv simulate); see docs/simulate.md."""
