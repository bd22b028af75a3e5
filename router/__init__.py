"""The router: OIP v2 front door, admission, dispatch with policies, admin API, metrics."""
