"""Pool policies loaded by import path: `pool.name=examples.pool_policies.<module>:<Class>`."""
