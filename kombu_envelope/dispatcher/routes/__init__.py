"""The dispatcher's endpoints, one module per kind of resource."""
