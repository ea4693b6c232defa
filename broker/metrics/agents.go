package metrics

import "github.com/prometheus/client_golang/prometheus"

// AgentsCollector reports the agents connected now, asked at scrape time so
// it never disagrees with the registry. Totals always; the agents of each
// logical cluster only with PerCluster set (--metrics-per-cluster), as a
// replica may serve 100,000 clusters, each a series.
type AgentsCollector struct {
	// Totals are the registry's totals: agents, clusters served, clusters
	// served by exactly one agent. It must not wait on the registry.
	Totals func() (agents, clusters, singleAgentClusters int64)
	// PerCluster counts the agents of each cluster; nil: not exported.
	PerCluster func() map[string]int
}

var (
	agentsDesc         = prometheus.NewDesc(ns+"_agents", "Agents connected to this replica, by logical cluster they serve (only with --metrics-per-cluster).", []string{"cluster"}, nil)
	registrationsDesc  = prometheus.NewDesc(ns+"_registered_agents", "Agent registrations (control streams) on this replica.", nil, nil)
	clustersDesc       = prometheus.NewDesc(ns+"_clusters_served", "Logical clusters that at least one agent serves.", nil, nil)
	singleClustersDesc = prometheus.NewDesc(ns+"_clusters_single_agent", "Logical clusters that exactly one agent serves.", nil, nil)
)

// Describe implements prometheus.Collector.
func (c AgentsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- registrationsDesc
	ch <- clustersDesc
	ch <- singleClustersDesc
	if c.PerCluster != nil {
		ch <- agentsDesc
	}
}

// Collect implements prometheus.Collector.
func (c AgentsCollector) Collect(ch chan<- prometheus.Metric) {
	agents, clusters, single := c.Totals()
	ch <- prometheus.MustNewConstMetric(registrationsDesc, prometheus.GaugeValue, float64(agents))
	ch <- prometheus.MustNewConstMetric(clustersDesc, prometheus.GaugeValue, float64(clusters))
	ch <- prometheus.MustNewConstMetric(singleClustersDesc, prometheus.GaugeValue, float64(single))
	if c.PerCluster == nil {
		return
	}
	for cluster, n := range c.PerCluster() {
		ch <- prometheus.MustNewConstMetric(agentsDesc, prometheus.GaugeValue, float64(n), cluster)
	}
}
