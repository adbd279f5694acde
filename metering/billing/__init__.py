"""The billing-grade ledger's routes beyond the proxy: usage recorded from outside
(POST /v1/events), corrections (POST /v1/rerate, POST /v1/adjustments) and the FOCUS export."""
