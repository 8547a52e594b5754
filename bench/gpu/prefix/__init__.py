"""Cache-aware routing on real engines: two nodes sharing GPU 0 under four balancers
(``prefix05`` / ``prefix7``). ``phases`` (the phases and their workload), ``load`` (the
multi-tenant shared-prefix load, spelled for the engine's tokenizer), ``report`` (its tables)."""
