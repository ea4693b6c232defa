package metrics

import "github.com/prometheus/client_golang/prometheus"

// AgentsCollector reports the agents connected now, per cluster, asked at
// scrape time so it never disagrees with the registry.
type AgentsCollector struct {
	PerCluster func() map[string]int
}

var agentsDesc = prometheus.NewDesc(ns+"_agents", "Agents connected to this replica, by logical cluster they serve.", []string{"cluster"}, nil)

// Describe implements prometheus.Collector.
func (c AgentsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- agentsDesc }

// Collect implements prometheus.Collector.
func (c AgentsCollector) Collect(ch chan<- prometheus.Metric) {
	for cluster, n := range c.PerCluster() {
		ch <- prometheus.MustNewConstMetric(agentsDesc, prometheus.GaugeValue, float64(n), cluster)
	}
}
