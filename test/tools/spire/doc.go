// Package spire pins the SPIRE server and agent that the end-to-end tests
// run, as tool dependencies of this module; spire.mk builds them.
package spire
