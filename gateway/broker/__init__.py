"""The gateway's link to RabbitMQ (`gateway.broker.link.Broker`) and what it knows of the
workers (their pool states)."""
